"""Load status: stages and weight bytes reported while a store is read; on a terminal one line
rewritten in place and erased when the model is ready; nothing when stderr is not a terminal."""

from __future__ import annotations

import io

from localgen.cli.status import CLEAR_LINE, clear, stderr_status
from localgen.models.load_progress import LoadProgress


class Store:
    sizes = {"a": 3 << 20, "b": 5 << 20}

    def names(self):
        return list(self.sizes)

    def nbytes(self, name):
        return self.sizes[name]

    def get(self, name):
        return f"tensor {name}"

    def get_packed(self, name):
        return None  # not kept packed: read through get


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_weight_bytes_are_counted_against_the_total():
    lines: list[str] = []
    p = LoadProgress(lines.append, interval=0)
    store = p.watch(Store())
    p.stage("loading weights")
    assert store.get("a") == "tensor a" and store.get_packed("b") is None and store.get("b")
    assert p.total_bytes == 8 << 20 and p.bytes_read == 8 << 20
    assert lines == ["loading weights", "loading weights: 3.0 / 8.0 MiB",
                     "loading weights: 8.0 / 8.0 MiB"]
    p.done("tiny loaded")
    assert lines[-1].startswith("tiny loaded (") and lines[-1].endswith(" s)")


def test_no_callback_leaves_the_store_alone():
    store = Store()
    assert LoadProgress(None).watch(store).get == store.get


def test_a_terminal_gets_one_line_rewritten_then_erased():
    out = Tty()
    show = stderr_status(out)
    show("opening the embedded model")
    show("loading weights: 3.0 / 8.0 MiB")
    assert out.getvalue() == CLEAR_LINE + "opening the embedded model" + CLEAR_LINE + "loading weights: 3.0 / 8.0 MiB"
    show("tiny loaded (0.4 s)")
    assert out.getvalue().endswith(CLEAR_LINE) and "\n" not in out.getvalue()
    clear(out)
    assert out.getvalue().endswith(CLEAR_LINE + CLEAR_LINE)


def test_a_pipe_gets_nothing():
    out = io.StringIO()
    stderr_status(out)("opening the embedded model")
    clear(out)
    assert out.getvalue() == ""
