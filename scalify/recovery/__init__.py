"""SCAR-style fault tolerance (Qiao et al., ICML 2019): a crash-safe checkpoint store for a
sharded parameter vector, traditional, partial and prioritized checkpoint strategies, a Ray
parameter server whose restarted shards recover from the store, and a harness that measures
the rework cost of a failure beside the theoretical bound."""
