"""One module per dashboard: its panels, in the sections it shows them, and the dashboard itself."""
