"""Entry point for DeepSpeed's launcher: `deepspeed --num_gpus N --module dostune.bench --config ds_config.json ...`.

Every rank runs every method on its own partition; rank 0 writes the result with the slowest rank's phases and
every rank's peak memory (bench/run.py). The launcher's --local_rank argument is dropped: the rank comes from the
environment.
"""
import sys

from ..cli.app import main

# guarded: a `spawn` child imports __main__ again
if __name__ == "__main__":
    sys.argv = [sys.argv[0], "bench", *[a for a in sys.argv[1:] if not a.startswith("--local_rank")]]
    main()
