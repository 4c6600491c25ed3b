"""How the shards of one sharded decode talk to each other: the ShardComm interface with its
thread emulation and row splits (shard_comm.py), and the same collectives over NCCL (nccl.py,
CuPy; imported only where GPUs are joined)."""
