"""zerofx beside DDP, FSDP2 and DeepSpeed on one model and one data stream; run by ``benchmarks/compare_peers.py``."""
