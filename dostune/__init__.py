"""dostune: Deep Optimizer States for DeepSpeed ZeRO-3 with CPU optimizer offload.

Library API (the CLI is a thin layer over it)::

    import dostune
    prof = dostune.measure_node(dostune.NodeProfileOptions())
    dostune.save_record(prof, "profiles/mynode.json")
    prof = dostune.load_node_profile("profiles/mynode.json")

    # the interleaved optimizer: a drop-in for deepspeed.initialize, driven by the config's "dostune" section
    engine, optimizer, _, _ = dostune.initialize(model=model, config="ds_config.json",
                                                 model_parameters=model.parameters())
"""
from ._version import __version__
from .errors import ConfigError, DostuneError, NotAvailable, ProfileError
from .profile.node import NodeProfileOptions, measure_node
from .leaf_blocks import mark_leaf_blocks
from .optim.api import HFTrainerCallback, attach, initialize
from .profile.record import NodeProfile, load_node_profile
from .records import save_record

__all__ = [
    "__version__", "DostuneError", "ProfileError", "ConfigError", "NotAvailable",
    "NodeProfile", "NodeProfileOptions", "measure_node", "load_node_profile", "save_record",
    "initialize", "attach", "HFTrainerCallback", "mark_leaf_blocks",
]
