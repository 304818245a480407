"""Entry point for DeepSpeed's launcher: `deepspeed --num_gpus N --module dostune.train --config ... --model ...`.

Every rank runs the same `dostune train` command; the launcher sets RANK / LOCAL_RANK / WORLD_SIZE and
each rank updates its own ZeRO-3 partition with the interleaved optimizer.
"""
import sys

from ..cli.app import main

sys.argv = [sys.argv[0], "train", *[a for a in sys.argv[1:] if not a.startswith("--local_rank")]]
main()
