"""What a deploy checks before it replaces anything (issue 35 #11): the job store answers, with a schema this h3trt
knows, and the storage takes a file. Each wrong `--store` or `--storage` is one line that names the problem and the
fix, within seconds, instead of a fleet whose every job then fails (a read-only storage) or a traceback half a minute
into the deploy (a wrong port)."""

from __future__ import annotations

import uuid

from ..errors import UserError
from ..server.storage import Storage
from ..server.store import JobStore

PROBE_PREFIX = ".h3trt-preflight-"

# What psycopg says (lower case) for each way a reachable URL is still wrong, and what to do about it.
STORE_FAULTS = (
    (("password authentication failed", "no password supplied", "authentication failed", "role"),
     "the server refused its user or password: fix the user:password in --store"),
    (("does not exist",), "the database does not exist on that server: create it (createdb NAME) or fix the name"),
    (("connection refused",), "nothing accepts connections there: check the port (PostgreSQL's is 5432) and that the "
                              "server runs"),
    (("could not translate host name", "name or service not known", "nodename nor servname", "temporary failure in "
      "name resolution"), "the host name does not resolve: fix the host in --store"),
    (("timeout expired", "timed out", "no route to host", "network is unreachable"),
     "the host does not answer: check the host, the network and the firewall"),
)


def preflight(store_url: str, storage_url: str) -> None:
    """Raise UserError (one line) unless the store is reachable with a known schema (migrated to it) and the storage
    takes, shows and removes a file."""
    check_store(store_url)
    check_storage(storage_url)


def check_store(url: str) -> None:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise UserError(f"--store {url!r} is not a database URL: pass postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB."
                        ) from None
    shown = parsed.render_as_string(hide_password=True)
    if not parsed.drivername.startswith("postgresql"):
        raise UserError(f"--store {shown}: a fleet's job store is PostgreSQL ({parsed.drivername!r} is not); pass "
                        "postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB.")
    try:
        JobStore(url).close()  # connects, and migrates to the newest schema (refuses a newer one: UserError)
    except NoSuchModuleError:
        raise UserError(f"--store {shown}: SQLAlchemy has no driver {parsed.drivername!r}; use postgresql+psycopg "
                        "(pip install 'h3trt[fleet]').") from None
    except DBAPIError as e:
        said = " ".join(str(e.orig if e.orig is not None else e).split())
        lowered = said.lower()
        why = next((fix for marks, fix in STORE_FAULTS if any(m in lowered for m in marks)), None)
        if why is None:
            why = f"the server answered: {said[:200]}"
        raise UserError(f"--store {shown}: cannot use the job store: {why}.") from None


def check_storage(url: str) -> None:
    try:
        storage = Storage(url)
    except OSError as e:
        raise UserError(f"--storage {url}: cannot create it ({e.strerror or e}); pass a folder this user can write, "
                        "mounted on every node, or an s3:// URL.") from None
    except (ImportError, ValueError) as e:
        raise UserError(f"--storage {url}: {e}") from None
    key = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    try:
        storage.work_path(key).write_bytes(b"h3trt")
        storage.publish(key)
        if not storage.exists(key):
            raise OSError(f"a file written as {key} is not there after")
        storage.remove(key)
    except OSError as e:
        storage.remove(key)
        raise UserError(f"--storage {url}: cannot write there ({e.strerror or e}); every replica writes its clips "
                        "there: pass a writable folder (on every node) or bucket.") from None
    finally:
        storage.close()
