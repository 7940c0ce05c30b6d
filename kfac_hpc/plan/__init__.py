"""Scale planner: cost model of distributed K-FAC per strategy, calibration, ``auto``.

* :mod:`~kfac_hpc.plan.model_shapes`: K-FAC layer shapes of a real ``nn.Module``;
* :mod:`~kfac_hpc.plan.collectives`: α–β formulas of the MPI collectives;
* :mod:`~kfac_hpc.plan.options`: the preconditioner settings priced (``KFACOptions``);
* :mod:`~kfac_hpc.plan.distribution`: who owns and sends what: exact bytes and memory
  per rank;
* :mod:`~kfac_hpc.plan.timing`: predicted time per iteration (``estimate``);
* :mod:`~kfac_hpc.plan.profile`: machine profiles (JSON; bundled examples);
* :mod:`~kfac_hpc.plan.choose`: candidates, the plan table, the ``auto`` choice;
* :mod:`~kfac_hpc.plan.calibrate` / :mod:`~kfac_hpc.plan.cli`: ``kfac-hpc calibrate``
  and ``kfac-hpc plan``.
"""

from kfac_hpc.plan.choose import Choice, baselines, candidates, choose, plan
from kfac_hpc.plan.distribution import Distribution, StepTraffic, construction_traffic
from kfac_hpc.plan.model_shapes import LayerSpec, ModelSpec, model_spec
from kfac_hpc.plan.options import KFACOptions
from kfac_hpc.plan.profile import ComputeRates, Profile, bundled_profiles, load_profile
from kfac_hpc.plan.timing import Estimate, estimate, estimate_sgd

__all__ = [
    "Choice",
    "ComputeRates",
    "Distribution",
    "Estimate",
    "KFACOptions",
    "LayerSpec",
    "ModelSpec",
    "Profile",
    "StepTraffic",
    "baselines",
    "bundled_profiles",
    "candidates",
    "choose",
    "construction_traffic",
    "estimate",
    "estimate_sgd",
    "load_profile",
    "model_spec",
    "plan",
]
