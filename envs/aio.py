"""Running a coroutine to completion from synchronous code, inside a running event loop too.

`asyncio.run` refuses to start when the calling thread already runs an event loop, which is
the case in every Jupyter / Colab cell (the kernel's own loop). `run` works in both places: with
no loop running it is `asyncio.run`; otherwise it runs the coroutine on a fresh loop in a
helper thread and waits for it, so library code that a notebook reaches never needs
`nest_asyncio` or an `await` at the call site.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


def run(coroutine: Coroutine[Any, Any, T]) -> T:
  """The result of `coroutine`, run to completion on an event loop of its own.

  Args:
    coroutine: the coroutine to run (not yet awaited).

  Returns:
    What it returns; an exception it raises propagates.
  """
  try:
    asyncio.get_running_loop()
  except RuntimeError:  # no loop in this thread: the ordinary case
    return asyncio.run(coroutine)
  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="arbor-aio") as pool:
    return pool.submit(asyncio.run, coroutine).result()
