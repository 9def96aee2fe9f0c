"""One contract test case per registered system (`tests/support/system_contract.py`): smoke row, config
round trip, `load_run(...).model.evaluate` = results.json, export + reload + warm-up replay, bad
requests. The fifth system of `tests/fifth_system` runs the same check after registering."""
import shutil

import pytest

from tf_twobranch import systems
from tf_twobranch.data.embedded import generate_embedded_dataset

from tests.support.system_contract import check_system_contract


@pytest.fixture(scope="module")
def shared_dataset(tmp_path_factory):
    return generate_embedded_dataset(tmp_path_factory.mktemp("data") / "scenes", num_images=60,
                                     splits=(40, 5, 15), num_proposals=30)


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in systems.all()])
def test_every_system_keeps_the_contract(name, shared_dataset, tmp_path):
    # Each system writes its caches into its dataset folder: a copy keeps the shared one as built.
    dataset = shutil.copytree(shared_dataset, tmp_path / "scenes")
    check_system_contract(systems.get(name), dataset, tmp_path)
