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


def test_deepspeed_install_by_hand_compares_the_settings_before_it_touches_the_engine(monkeypatch):
    """``install`` called by hand (the Trainer callback, the launchers' measuring-only runs) checks the ranks'
    settings first; ``initialize`` hands its own check's result on, so a rank checks once per install."""
    import pytest

    pytest.importorskip("deepspeed")
    from chameleon_dist.integrations.deepspeed import engine as ds_engine

    class Refused(Exception):
        pass

    calls = []

    def refuse(config, **kwargs):
        calls.append(kwargs)
        raise Refused

    monkeypatch.setattr(ds_engine, "agree_on_settings", refuse)
    with pytest.raises(Refused):
        ds_engine.install(object(), ChameleonConfig())  # (an engine it would fail on: nothing was touched)
    assert calls == [{"prefix": "chameleon."}]
    with pytest.raises(AttributeError):  # given initialize's result, it goes on to the engine
        ds_engine.install(object(), ChameleonConfig(), peers=object())
    assert len(calls) == 1
