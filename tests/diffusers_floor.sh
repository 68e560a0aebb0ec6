#!/usr/bin/env bash
# The exactness tests of every strategy against the oldest diffusers pyproject.toml allows ("diffusers>=X").
#
# That diffusers goes into its own environment, .floor-env/, layered over this one (it sees this
# environment's packages, its own come first), so the newest diffusers installed here stays as it is.
# pip resolves the floor together with the whole project there, so every package that shares the floor's
# dependencies gets a version that accepts them (diffusers < 0.41 needs huggingface_hub < 2; a transformers released
# after it may need a newer huggingface_hub, so transformers is resolved again there too), and `pip check` proves it.
set -euo pipefail
cd "$(dirname "$0")/.."

floor=$(sed -n 's/^ *"diffusers>=\([0-9][0-9.]*\)",$/\1/p' pyproject.toml)
if [ -z "$floor" ]; then
    echo "diffusers_floor.sh: no \"diffusers>=X\" line in pyproject.toml's dependencies; write the floor there" >&2
    exit 1
fi

rm -rf .floor-env
python -m venv .floor-env
site=$(.floor-env/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python -c 'import sysconfig; print("import site; site.addsitedir(%r)" % sysconfig.get_paths()["purelib"])' \
    > "$site/zz_parent_environment.pth"
if ! .floor-env/bin/python -m pip install -q "diffusers==$floor" -e ".[test]"; then
    echo "diffusers_floor.sh: could not install diffusers==$floor (the floor in pyproject.toml) with paradiff's" \
        "dependencies into .floor-env" >&2
    exit 1
fi
if ! .floor-env/bin/python -m pip check; then
    echo "diffusers_floor.sh: the packages in .floor-env conflict (above); pin the one pip could not resolve" >&2
    exit 1
fi
.floor-env/bin/python -c "
import sys, diffusers
from packaging.version import Version
print('diffusers floor run: diffusers', diffusers.__version__, 'from', diffusers.__file__)
sys.exit(0 if Version(diffusers.__version__) == Version('$floor') else 'expected diffusers $floor')
"
# Selected: every exactness test (on latents, tests/exactness.py) and every restore test, all of test_compat.py
# (its module name is a -k keyword of each of its tests), parastep's and asyncdiff's displaced runs against
# their single-process references (their exact runs are all warm-up: they move no bytes), and the step caches' exact
# cases (every cache paradiff adapts exists in the floor's diffusers). On 2 ranks only: what differs between diffusers
# versions is what a strategy meets in the model (hooks, processors, configs), the same at any number of ranks, and
# a pool of 4 more workers, each importing diffusers, would cost this run a fifth of its time. In this process (-n 0):
# these tests keep both cores busy on their 2 ranks, and a second xdist worker would only start a second pool.
.floor-env/bin/python -m pytest -q -p no:cacheprovider -n 0 \
    -k "(exact or restores or test_compat or match_the_reference) and not 4_ranks and not four_ranks" \
    tests/test_patch_exactness.py tests/test_cfg.py tests/test_sequence.py tests/test_pipefusion.py \
    tests/test_parastep.py tests/test_asyncdiff.py tests/test_compat.py tests/test_families.py tests/test_step_caches.py
