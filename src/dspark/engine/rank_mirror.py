"""``RankMirror``: rank 0's side of a tensor-parallel ``LLMEngine`` (``LLMEngine`` inherits it).

Rank 0 mirrors every call that changes an engine's state to the other ranks (``_mirror``, an
``Op`` each: ``ranks.py`` says which and how they replay them), turns an error inside a call into
``EngineDeadError`` for the whole job (``_rank_failures``), agrees with them on a request's failure
before failing it (``_agree``) and stops them (``close``). With one rank each is a no-op. It reads
the engine's ``ranks`` (the ``RankGroup`` rank 0 started, else None) and ``peers`` (who agrees on a
request's failure: rank 0's ``RankGroup`` or another rank's ``RankLink``, else None).
"""

from __future__ import annotations

import contextlib

from .ranks import EngineDeadError, Op

__all__ = ["RankMirror"]


class RankMirror:
    """Rank 0's mirroring of engine calls to the other tensor-parallel ranks, and their failures."""

    def _rank_engine(self):
        """What the other ranks build, called as ``(target, draft, config, rank=)``: this class (a
        subclass with more constructor arguments gives them here, e.g. a ``functools.partial``)."""
        return type(self)

    def on_every_rank(self, method: str, *args):
        """Call this engine's ``method(*args)`` on every rank (rank 0's result): work whose
        collectives every rank must make alike, e.g. ``profile_costs``."""
        self._mirror(Op("call", (method, args)))
        with self._rank_failures():
            return getattr(self, method)(*args)

    def _mirror(self, op: Op) -> None:
        """Rank 0: ``op`` to the other ranks, which make the same call on their engines."""
        if self.ranks is not None:
            self.ranks.send(op)

    @contextlib.contextmanager
    def _rank_failures(self):
        """Rank 0: an error inside (not a request's failure every rank saw: ``_fail``) ends every
        rank, raised as ``EngineDeadError`` naming the rank that failed first (a rank's own error,
        when it sent one, is the cause of rank 0's); an interrupt (Ctrl-C) stops the ranks too --
        they may be inside a step rank 0 left -- and goes on."""
        if self.ranks is None:
            yield
            return
        try:
            yield
        except EngineDeadError:  # the ranks' failure, said already
            raise
        except Exception as exc:  # noqa: BLE001
            raise self.ranks.failure(exc) from exc
        except BaseException:
            self.ranks.close(failed=True)
            raise

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing with one rank). The engine runs no more steps."""
        if self.ranks is not None:
            self.ranks.close()

    def _agree(self, what: str, request_ids: list[int]) -> None:
        """Under tensor parallelism, return once every rank failed ``what`` for ``request_ids``
        (a failure that comes from the requests: raised on every rank alike); a failure some ranks
        did not see ends the job (``ranks.RankGroup.agree``). Nothing with one rank."""
        if self.peers is not None:
            self.peers.agree((what, tuple(request_ids)))
