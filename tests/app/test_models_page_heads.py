"""The models page's catalog tab with an EAGLE-3 head pair (catalog role "head"): listed like
every pair, its Draft cell saying it is a head trained for the target, its download the target's
files plus the head's, and its speed priced as a head (one layer and its output head per draft
pass, the EAGLE-3 prior of engine.decoding.draft_choice), not as a small draft model."""

from __future__ import annotations

from dataclasses import replace

from answers import refusing
from pages_hub import HubServer
from pytestqt.qtbot import QtBot

from app.models.page import CATALOG_COLUMNS, COL_FIT, COL_SPEED, ModelsPage
from app.models.recommend import format_speed
from app.state.preferences_store import PreferencesStore
from engine.decoding.draft_choice import prior_curve
from engine.planning import planner
from engine.planning.calibration import saved_curve
from engine.planning.profile import save_profile
from engine.planning.reference import reference_profile
from engine.store import load_catalog
from engine.store.transfer import DownloadSettings
from engine.units import format_bytes

pytest_plugins = ("pages_fixtures",)  # app_env, prefs_store, hub, ... fixtures

PAIR, TARGET, HEAD = "llama-3.3-70b+eagle3", "llama-3.3-70b-instruct", "llama-3.3-70b-instruct-eagle3"


def test_a_head_pair_is_listed_sized_and_priced_as_a_head(
    qtbot: QtBot, prefs_store: PreferencesStore, hub: HubServer, download_settings: DownloadSettings,
) -> None:
    profile = reference_profile("rtx4090")  # datasheet figures: the same prediction on every machine
    save_profile(profile)
    page = ModelsPage(prefs_store, endpoint=hub.url, download_settings=download_settings, dialogs=refusing())
    qtbot.addWidget(page)
    try:
        table = page.catalog.table
        row = next(r for r in range(table.rowCount()) if table.item(r, 0).data(256) == PAIR)

        def cell(name: str) -> str:
            return table.item(row, CATALOG_COLUMNS.index(name)).text()

        catalog = load_catalog()
        target, head = catalog.find(TARGET), catalog.find(HEAD)
        assert target is not None and head is not None
        assert cell("Target") == TARGET and cell("Format") == "BF16"
        assert cell("Draft") == f"{HEAD} (EAGLE-3 head)"
        assert "EAGLE-3 head trained for " + TARGET in table.item(row, CATALOG_COLUMNS.index("Draft")).toolTip()
        assert "EAGLE-3 head trained for it" in cell("About")
        assert cell("Download") == format_bytes(target.download_bytes + head.download_bytes)
        option = next(o for o in page.options() if o.pair_id == PAIR)
        assert cell("On disk") == "no" and page.catalog.missing(option) == [TARGET, HEAD]  # Download fetches both

        # priced as a head: the EAGLE-3 prior over the head's one layer, not the draft-model prior
        as_head = planner.predict_pair(profile, target, head, curve=prior_curve("assistant"))
        as_model = planner.predict_pair(profile, target, replace(head, role="draft"), curve=saved_curve())
        assert as_head.tokens_per_second > as_model.tokens_per_second
        assert table.item(row, COL_SPEED).text() == f"~{format_speed(as_head.tokens_per_second)} tok/s predicted"
        assert table.item(row, COL_FIT).text() == {"fits": "Fits", "slow": "Slow", "too big": "Too big"}[as_head.fit]
        # the 1B draft model's pair of the same target is priced as before, side by side
        plain = next(o for o in page.options() if o.pair_id == "llama-3.3-70b+1b")
        assert plain.draft_role == "draft" and plain.tokens_per_second == planner.predict_pair(
            profile, target, catalog.find("llama-3.2-1b-instruct"), curve=saved_curve()).tokens_per_second
    finally:
        page.shutdown()
