"""The objective priorities a pool source publishes: readers see whole sets, and cannot write."""

from __future__ import annotations

import pytest

from epp.datalayer.objectives import ObjectivePriorities


def test_readers_see_the_last_published_set_whole_and_cannot_change_it() -> None:
    priorities = ObjectivePriorities()
    assert dict(priorities) == {}
    published = {"chat": 5, "batch": -1}
    priorities.publish(published)
    published["chat"] = 0  # the publisher's own dict is not shared
    assert priorities == {"chat": 5, "batch": -1} and priorities.get("other") is None
    priorities.publish({"batch": 0})
    assert dict(priorities) == {"batch": 0}
    with pytest.raises(TypeError):
        priorities["chat"] = 1  # type: ignore[index]
