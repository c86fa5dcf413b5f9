"""A Ray cluster of a test's own (issue 35 item 2): never another cluster on the machine. `ray.init(address="local")`
starts a new head whatever RAY_ADDRESS or the session file in Ray's default temp folder (/tmp/ray/ray_current_cluster)
say; its folder is private and short (Unix socket paths stay under 107 bytes), its ports Ray's random ones (no
dashboard, no client server); its token authentication (on by default for a new local cluster) uses a token of its
own in that folder, never ~/.ray/auth_token (which Ray would otherwise read, or write). While it runs, this process
and the processes it starts (with os.environ) reach it through RAY_AUTH_MODE/RAY_AUTH_TOKEN_PATH; RAY_ADDRESS is
unset. Everything is put back after."""

import os
import secrets
import shutil
import tempfile
from contextlib import contextmanager

RAY_ENV = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@contextmanager
def isolated_ray(**init_kwargs):
    """Yields ray.init's context (`address_info["gcs_address"]`, the head's host:port) and the cluster's folder."""
    import ray

    if ray.is_initialized():
        # ray.init(address="local") would refuse with "Maybe you called ray.init twice by accident?": say whose.
        raise RuntimeError("isolated_ray: this process already holds a Ray cluster (a module fixture's?); start the "
                           "second cluster in a child process or in another test module")
    saved = {k: os.environ.pop(k) for k in RAY_ENV if k in os.environ}
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short whatever TMPDIR says: the socket paths
    token = os.path.join(ray_dir, "auth_token")
    with open(token, "w") as f:
        f.write(secrets.token_hex(32))
    # RAY_AUTH_MODE unset: ray.init turns token mode on for a new local cluster (and refreshes its config, read at
    # import), taking the token from RAY_AUTH_TOKEN_PATH.
    os.environ["RAY_AUTH_TOKEN_PATH"] = token
    try:
        context = ray.init(address="local", include_dashboard=False, log_to_driver=False, _temp_dir=ray_dir,
                           **init_kwargs)
        try:
            yield context, ray_dir
        finally:
            ray.shutdown()
    finally:
        for k in RAY_ENV:
            os.environ.pop(k, None)
        os.environ.update(saved)
        shutil.rmtree(ray_dir, ignore_errors=True)
