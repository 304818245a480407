"""Entry point for DeepSpeed's launcher: `deepspeed --num_gpus N --module dostune.profile --model M ...`.

Every rank profiles the model on its own ZeRO-3 partition; rank 0 writes one model profile with every rank's
phases (docs/multi-gpu.md). The launcher's --local_rank argument is dropped: the rank comes from the environment.
"""
import sys

from ..cli.app import main

# guarded: a `spawn` child (the node profile's concurrent CPU Adam runs in some) imports __main__ again
if __name__ == "__main__":
    sys.argv = [sys.argv[0], "profile", *[a for a in sys.argv[1:] if not a.startswith("--local_rank")]]
    main()
