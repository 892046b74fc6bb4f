"""What watches a run without steering it: the HTTP API and dashboard, Prometheus metrics,
TensorBoard scalars, and the run's reports."""
