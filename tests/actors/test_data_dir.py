"""The data directory is its owner's alone: 0700, every file in it 0600, what an older version left
tightened, and files made afterwards (the registry, its WAL) created that way. No model, no Ray."""

from __future__ import annotations

import os
import stat

from actors.config import prepare_data_dir
from storage.registry import Registry


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_data_directory_is_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        data = tmp_path / "data"
        (data / "chunks" / "abc").mkdir(parents=True)
        os.chmod(data, 0o755)
        (data / "registry.db").write_bytes(b"")
        os.chmod(data / "registry.db", 0o644)
        (data / "chunks" / "abc" / "0.kvp").write_bytes(b"x")
        os.chmod(data / "chunks" / "abc" / "0.kvp", 0o664)
        prepare_data_dir(data)
        assert mode(data) == 0o700 and mode(data / "chunks") == 0o700 and mode(data / "chunks" / "abc") == 0o700
        assert mode(data / "registry.db") == 0o600 and mode(data / "chunks" / "abc" / "0.kvp") == 0o600
        reg = Registry(str(data / "new.db"))
        reg.create_app("a")
        for name in ("new.db", "new.db-wal", "new.db-shm"):
            if (data / name).exists():
                assert mode(data / name) == 0o600, name
        reg.close()
        prepare_data_dir(tmp_path / "fresh" / "data")
        assert mode(tmp_path / "fresh" / "data") == 0o700
    finally:
        os.umask(old)
