"""The detection worker: the Faust app, its transport, the detector process and its health endpoint."""
