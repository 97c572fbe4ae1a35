"""Where a campaign keeps its hypothesis example corpus: a directory, or a Redis server.

``open_database(spec, out)``: ``spec`` None keeps the corpus in ``OUT/hypothesis-db`` (a
hypothesis ``DirectoryBasedExampleDatabase``, safe for several worker processes at once); a
``redis://host:port/db`` URL shares one corpus between campaigns on several machines (hypothesis's
own ``RedisExampleDatabase``). Both are hypothesis's classes: nothing here reimplements them.
"""

from __future__ import annotations

from pathlib import Path


class DatabaseError(Exception):
    pass


def open_database(spec: str | None, out: Path):
    from hypothesis.database import DirectoryBasedExampleDatabase
    if spec is None or spec == "":
        return DirectoryBasedExampleDatabase(str(Path(out) / "hypothesis-db"))
    if spec.startswith(("redis://", "rediss://", "unix://")):
        try:
            import redis
            from hypothesis.extra.redis import RedisExampleDatabase
        except ImportError as e:
            raise DatabaseError(f"--db {spec}: the Redis database needs the 'redis' package "
                                f"(pip install redis): {e}") from None
        client = redis.Redis.from_url(spec)
        try:
            client.ping()
        except redis.exceptions.RedisError as e:
            raise DatabaseError(f"--db {spec}: cannot reach the Redis server ({e})") from None
        return RedisExampleDatabase(client, key_prefix=b"simsched-hypothesis:")
    return DirectoryBasedExampleDatabase(spec)
