"""The deployment grid's reply polls (PromptReplies), on a fake clock: a reply is collected within
5% of its wait (at least 0.1 s), with few pulls, and a timeout is kept."""

from types import SimpleNamespace

import pytest

from protofl import server_app
from protofl.server_app import PromptReplies


class SlowNodes:
    """A grid whose reply to each message arrives ``delay`` seconds (fake clock) after it was pushed."""

    def __init__(self, clock, delays):
        self.clock, self.delays, self.pulls = clock, delays, 0

    def push_messages(self, messages):
        self.pushed = self.clock.now
        return [str(i) for i, _ in enumerate(messages)]

    def pull_messages(self, message_ids):
        self.pulls += 1
        arrived = [i for i in message_ids if self.clock.now >= self.pushed + self.delays[int(i)]]
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i)) for i in arrived]


@pytest.fixture
def clock(monkeypatch):
    clock = SimpleNamespace(now=0.0)

    def sleep(seconds):
        assert seconds > 0
        clock.now += seconds

    monkeypatch.setattr(server_app.time, "monotonic", lambda: clock.now)
    monkeypatch.setattr(server_app.time, "sleep", sleep)
    return clock


@pytest.mark.parametrize("delay", [0.3, 1.0, 20.0, 600.0])
def test_each_reply_is_collected_soon_after_it_arrives(clock, delay):
    nodes = SlowNodes(clock, [delay / 2, delay])
    replies = PromptReplies(nodes).send_and_receive(["a", "b"])
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["0", "1"]
    assert delay <= clock.now <= delay + max(0.1, min(delay / 20, 3.0)) + 1e-9
    assert nodes.pulls <= delay / 0.1 + 2 and nodes.pulls <= delay / 3 + 100  # Flower's fixed 3 s: delay / 3


def test_a_timeout_is_kept(clock):
    nodes = SlowNodes(clock, [100.0])
    assert PromptReplies(nodes).send_and_receive(["a"], timeout=7.5) == []
    assert clock.now == pytest.approx(7.5)
