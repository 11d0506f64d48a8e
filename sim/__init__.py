"""A discrete-event simulator of a stepserve cluster that runs stepserve's own decision code: each
simulated replica is the real `replica.scheduler.Scheduler` and KV cache manager, the routers
decide with the Ray router's `router.decision` over `router.inflight`'s tallies, the autoscaler
is `cluster.autoscaling`. Only the forward pass is replaced, by a step-time model measured on a
real engine (`stepserve profile`, sim/profile.py). No Ray: see docs/simulator.md."""
