"""Dialogs of `localgen chat` beyond the settings: help (built from the live key bindings),
yes/no confirmation, copy (the last answer or one of its code blocks) and the saved chats
(open, rename, delete)."""

from __future__ import annotations

import time
from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, DataTable, Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from localgen.tui.chat_widgets import code_blocks
from localgen.tui.history import ChatStore

_CSS = """
{name} {{ align: center middle; }}
{name} > Vertical {{ width: 76; max-width: 100%; height: auto; max-height: 100%;
    border: round $primary; padding: 0 1; background: $surface; }}
{name} .title {{ text-style: bold; }}
{name} .hint {{ color: $text-muted; }}
{name} .error {{ color: $error; height: auto; }}
{name} Horizontal {{ height: auto; align-horizontal: right; }}
{name} Button {{ margin: 0 0 0 1; min-width: 8; }}
{name} OptionList {{ height: auto; max-height: 16; }}
"""


def binding_rows(screen: Screen) -> list[tuple[str, str, str]]:
    """``(keys, what it does, where)`` for every key binding active on ``screen`` now (the
    focused widget's, the screen's and the app's), one row per binding, keys joined by ", "."""
    rows: dict[tuple, tuple[list[str], str, str]] = {}
    app = screen.app
    for key, active in screen.active_bindings.items():
        b = active.binding
        where = ("everywhere" if active.node is app else "chat" if active.node is screen
                 else "message box")
        desc = b.description or b.action.replace("_", " ")
        entry = rows.setdefault((id(active.node), b.action, desc), ([], desc, where))
        entry[0].append(app.get_key_display(Binding(key, b.action)))
    order = {"everywhere": 0, "chat": 1, "message box": 2}
    out = [(", ".join(keys), desc, where) for keys, desc, where in rows.values()]
    return sorted(out, key=lambda r: order[r[2]])


class HelpScreen(ModalScreen[None]):
    """Every key binding of the screen it was opened from (``binding_rows``); Esc/F1/q close."""

    DEFAULT_CSS = _CSS.format(name="HelpScreen") + """
    HelpScreen > Vertical { width: 90; }
    HelpScreen DataTable { height: auto; max-height: 20; }
    """
    BINDINGS = [Binding("escape,f1,q,question_mark", "close", "Close")]

    def __init__(self, rows: list[tuple[str, str, str]]):
        super().__init__()
        self.rows = rows

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Keys (Esc closes)", classes="title")
            yield DataTable(id="help-keys", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("Keys", "Does", "Where")
        table.add_rows(self.rows)
        table.focus()

    def action_close(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    """A question with Yes / No (y / n; Esc is No)."""

    DEFAULT_CSS = _CSS.format(name="ConfirmScreen")
    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str, yes: str = "Yes"):
        super().__init__()
        self.question, self.yes = question, yes

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.question, id="question")
            with Horizontal():
                yield Button(self.yes, id="yes", variant="warning")
                yield Button("No", id="no", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class CopyScreen(ModalScreen[str | None]):
    """Pick what of an answer to copy: all of it or one code block; returns the text copied
    (None: cancelled). The copy goes through ``App.copy_to_clipboard`` (OSC 52)."""

    DEFAULT_CSS = _CSS.format(name="CopyScreen")
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, answer: str):
        super().__init__()
        self.choices = [("The whole answer", answer)]
        for i, (lang, code) in enumerate(code_blocks(answer), 1):
            first = code.strip().splitlines()[0] if code.strip() else ""
            self.choices.append((f"Code block {i}{f' ({lang})' if lang else ''}: {first[:40]}", code))

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Copy to the clipboard", classes="title")
            yield OptionList(*[Option(label, id=str(i)) for i, (label, _) in enumerate(self.choices)],
                             id="copy-choices")

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    @on(OptionList.OptionSelected)
    def chosen(self, event: OptionList.OptionSelected) -> None:
        label, text = self.choices[int(event.option.id)]
        self.app.copy_to_clipboard(text)
        self.app.notify(f"Copied: {label.split(':')[0].lower()}")
        self.dismiss(text)

    def action_cancel(self) -> None:
        self.dismiss(None)


class RenameScreen(ModalScreen[str | None]):
    """A new title for a saved chat (None: cancelled)."""

    DEFAULT_CSS = _CSS.format(name="RenameScreen")
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str):
        super().__init__()
        self.title_now = title

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Rename the chat", classes="title")
            yield Input(self.title_now, id="rename-title")
            yield Static("", id="rename-error", classes="error")

    @on(Input.Submitted)
    def submitted(self, event: Input.Submitted) -> None:
        title = " ".join(event.value.split())
        if not title:
            self.query_one("#rename-error", Static).update("a title cannot be empty")
            return
        self.dismiss(title)

    def action_cancel(self) -> None:
        self.dismiss(None)


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


class HistoryScreen(ModalScreen[str | None]):
    """The saved chats, newest first: Enter opens one (returns its id), r renames, d deletes
    (after asking), Esc closes (None)."""

    DEFAULT_CSS = _CSS.format(name="HistoryScreen")
    BINDINGS = [Binding("escape", "cancel", "Close"), Binding("r", "rename", "Rename"),
                Binding("d,delete", "delete", "Delete")]

    def __init__(self, store: ChatStore, current_id: str | None = None):
        super().__init__()
        self.store, self.current_id = store, current_id
        self.entries: list[Any] = []

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Saved chats", classes="title")
            yield Static(f"Enter opens · r renames · d deletes · Esc closes — in {self.store.root}",
                         classes="hint")
            yield OptionList(id="chats")
            yield Static("", id="history-error", classes="error")

    def on_mount(self) -> None:
        self.reload()
        self.query_one(OptionList).focus()

    def reload(self) -> None:
        self.entries = self.store.list()
        ol = self.query_one(OptionList)
        keep = ol.highlighted
        ol.clear_options()
        for e in self.entries:
            mark = " (this one)" if e.id == self.current_id else ""
            ol.add_option(Option(f"{e.title}{mark}\n  {_when(e.updated)} · {e.turns} messages · {e.id}",
                                 id=e.id))
        if not self.entries:
            ol.add_option(Option("No saved chats yet.", id="", disabled=True))
        else:
            ol.highlighted = min(keep or 0, len(self.entries) - 1)

    def _selected(self):
        i = self.query_one(OptionList).highlighted
        return self.entries[i] if i is not None and i < len(self.entries) else None

    @on(OptionList.OptionSelected)
    def chosen(self, event: OptionList.OptionSelected) -> None:
        if event.option.id:
            self.dismiss(event.option.id)

    def action_rename(self) -> None:
        entry = self._selected()
        if entry is None:
            return

        def done(title: str | None) -> None:
            if title:
                self._try(lambda: self.store.rename(entry.id, title))

        self.app.push_screen(RenameScreen(entry.title), done)

    def action_delete(self) -> None:
        entry = self._selected()
        if entry is None:
            return

        def done(yes: bool | None) -> None:
            if yes:
                self._try(lambda: self.store.delete(entry.id))

        self.app.push_screen(ConfirmScreen(f"Delete the chat “{entry.title}”? Its file is removed.",
                                           yes="Delete"), done)

    def _try(self, change) -> None:
        try:
            change()
        except (OSError, LookupError, ValueError) as e:
            self.query_one("#history-error", Static).update(str(e))
        self.reload()
        self.query_one(OptionList).focus()

    def action_cancel(self) -> None:
        self.dismiss(None)
