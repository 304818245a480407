"""The Optuna study behind `dostune tune` and `dostune plan`: the sampler, the key of the problem a study was made for
(a stored study resumes only for the same profiles, limits and search space), its storage (SQLite by default,
checked before any work), and the objective that asks for a schedule and scores it with the Space."""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ..errors import DostuneError
from ..profile.model_record import ModelProfile
from ..profile.record import NodeProfile
from ..profile.timing import ProgressSink
from ..records import check_writable
from .space import GPU_SHARE, Space

if TYPE_CHECKING:  # search.py imports this module
    from .search import TuneOptions

SAMPLERS = ("tpe", "random", "qmc")


def _sampler(name: str, seed: int):
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=10)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "qmc":
        return optuna.samplers.QMCSampler(seed=seed)
    raise DostuneError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {name!r}")


# Bumped whenever the searched parameters or their scoring change (2: overlap_backward; 3: resident subgroups
# filling the peak-memory allowance, and the step prefetch in the model; 4: one rank of a world, and the node's
# pinned host memory as a constraint; 5: gpu_placement, and dostune's own backward in the model; 6: overlap_backward
# schedules at the lane probe's threads alone; 7: the regime scored, clipping or not; 8: overlap_backward searched
# without a model profile too), so that a stored study from an older search is not resumed as if its trials had
# explored the new space.
SEARCH_SPACE_VERSION = 8


def problem_key(node_p: NodeProfile, model_p: Optional[ModelProfile], opts: TuneOptions, space: Space) -> str:
    key = {"space": SEARCH_SPACE_VERSION,
           "node": [node_p.name, node_p.created], "model": [opts.model, model_p.created if model_p else None],
           "budget": space.budget_gib, "peak": space.max_peak_gib, "sizes": space.sub_group_sizes,
           "threads": space.threads, "world": space.world.as_config(), "host": space.host_budget_gib,
           "regime": space.regime}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _sqlite_without_fsync_per_commit(dbapi_connection, _record) -> None:
    """Optuna commits several times a trial; SQLite's default journal syncs the disk at each (half the wall time of a
    50-trial tune). A write-ahead log synced at checkpoints keeps every committed trial through a killed process, so
    the study still resumes."""
    import sqlite3

    if isinstance(dbapi_connection, sqlite3.Connection):
        cur = dbapi_connection.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()


def run_study(space: Space, opts: TuneOptions, storage: str, study_name: str, problem_key: str,
              progress: ProgressSink):
    import optuna
    import sqlalchemy
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(logging.WARNING)
    if not sqlalchemy.event.contains(sqlalchemy.engine.Engine, "connect", _sqlite_without_fsync_per_commit):
        sqlalchemy.event.listen(sqlalchemy.engine.Engine, "connect", _sqlite_without_fsync_per_commit)
    try:
        study = optuna.create_study(study_name=study_name, storage=storage, direction="minimize",
                                    sampler=_sampler(opts.sampler, opts.seed), load_if_exists=True)
    except DostuneError:
        raise
    except Exception as e:  # SQLAlchemy's OperationalError (not a database, locked, unreachable server) and kin
        first = str(e).splitlines()[0] if str(e) else ""
        raise DostuneError(f"cannot open the study storage {storage}: {type(e).__name__}: {first[:200]}",
                           hint="pass another --storage or --output-dir, or delete a damaged study.db") from None
    stored = study.user_attrs.get("problem")
    if stored is not None and stored != problem_key:
        raise DostuneError(f"study '{study_name}' in {storage} was made for other profiles or limits",
                           hint="pass another --study-name, or delete the study's database")
    if stored is None:
        study.set_user_attr("problem", problem_key)
    # A run that was killed leaves its in-flight trial RUNNING: close it so it is neither lost track of
    # nor counted; completed trials are already committed to SQLite and are kept.
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(t.number, state=TrialState.FAIL)
    if not study.trials:
        for c in space.closed_form_candidates():
            study.enqueue_trial(space.params(c))

    def objective(trial):
        # the parameters as Space.choices declares them, each unless those before it settle it, and the GPU lane's
        # share as a float
        params = {}
        for name, values in space.choices().items():
            if name not in space.settled(params):
                params[name] = trial.suggest_categorical(name, values)
        c = space.candidate({**params, GPU_SHARE: trial.suggest_float(GPU_SHARE, 0.0, 1.0)})
        p = space.evaluate(c)
        budget_over, peak_over, host_over = space.violations(p)
        # Optuna's constrained sampling (TPE) steers away from trials with positive values
        trial.set_constraint("staging_over_budget_gib", budget_over)
        trial.set_constraint("peak_over_limit_gib", peak_over)
        trial.set_constraint("pinned_over_host_gib", host_over)
        trial.set_user_attr("feasible", space.feasible(p))
        return p.objective_s

    done = sum(1 for t in study.trials if t.state == TrialState.COMPLETE)
    remaining = max(0, opts.trials - done)
    progress.start(f"searching schedules ({done} done, {remaining} to go)", max(remaining, 1))
    if remaining:
        study.optimize(objective, n_trials=remaining, callbacks=[lambda *_: progress.advance()])
    else:
        progress.advance()
    return study


def check_storage(url: str) -> None:
    """An Optuna storage URL that can be opened: a sqlite file in a writable folder, or a database URL that
    SQLAlchemy knows (a bad one otherwise fails deep inside SQLAlchemy)."""
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///"):]
        if path and path != ":memory:":
            check_writable(Path(path), "--storage")
        return
    try:
        from sqlalchemy.engine import make_url

        make_url(url).get_dialect()
    except Exception as e:  # ArgumentError, NoSuchModuleError, a missing driver (ImportError)
        raise DostuneError(f"--storage {url!r} is not a database URL this installation can open "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                           hint="use sqlite:///path/study.db (the default is one in --output-dir)") from None
