"""The settings check (``rank_agreement``) runs on every rank whether Chameleon is on or off there (issue 37 item
12): a rank with Chameleon off still reports ``enabled: false``, so the ranks with it on are refused at once
instead of waiting for a rank that never comes."""

from __future__ import annotations

import argparse

from chameleon_dist.config import ChameleonConfig
from chameleon_dist.integrations.megatron import lm_adaptor


def test_megatron_lm_without_chameleon_flags_still_takes_part_in_the_check(monkeypatch):
    seen: list[ChameleonConfig] = []
    monkeypatch.setattr(lm_adaptor, "agree_on_settings", lambda config, **kwargs: seen.append(config), raising=False)
    adaptor = lm_adaptor.MegatronLMAdaptor()
    adaptor.install_on(model=None, optimizer=None, args=argparse.Namespace())  # no --chameleon-* flag
    assert adaptor.chameleon is None
    assert [config.enabled for config in seen] == [False]
