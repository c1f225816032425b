"""`runwatch demo`: the whole loop on one machine, with any catalog scenario."""
