"""The supervisor process: it starts, watches and restarts the executor and the native front end, hands each its settings, forwards their logs and sums their metrics."""
