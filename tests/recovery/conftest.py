import pytest
import ray

from scalify.engine.cluster import LOCAL_TEMP_DIR


@pytest.fixture(scope="package")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(LOCAL_TEMP_DIR))
    yield
    ray.shutdown()
