"""fedmq's benchmark workload as a Flower App: the ClientApp trains a node and the ServerApp averages
and evaluates, each by calling fedmq's own steps (`experiments.bench.flower_workload.Workload`)."""
