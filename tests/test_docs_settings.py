"""docs/operations/settings.md lists every setting as the settings module declares it (generated table)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "settings_doc.py"


def _settings_doc():
    """scripts/ is no package: load the generator from its file."""
    spec = importlib.util.spec_from_file_location("settings_doc", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_settings_document_matches_the_settings_module():
    diff = _settings_doc().check()
    assert not diff, "docs/operations/settings.md is stale; run python scripts/settings_doc.py\n" + "\n".join(diff)


def test_every_key_has_one_row_with_its_default_and_range():
    doc = _settings_doc()
    rows = doc.table().splitlines()[2:]
    keys = [row.split("`")[1] for row in rows]
    assert keys == list(doc.settings.KEYS)
    factor = rows[keys.index("cpu.overprovisioning.factor")]
    assert "| float | 1.0 | (0, 100] | global, zone, cluster |" in factor


def test_a_stale_document_is_reported_and_rewritten(tmp_path, capsys):
    doc = _settings_doc()
    stale = tmp_path / "settings.md"
    stale.write_text(f"# Settings\n\n{doc.BEGIN}\n| old | table |\n{doc.END}\nafter\n")
    assert doc.main(["--check", "--doc", str(stale)]) == 1
    said = capsys.readouterr().err
    assert "is stale" in said and "-| old | table |" in said
    assert doc.main(["--doc", str(stale)]) == 0
    assert doc.check(stale) == []
    assert stale.read_text().endswith(f"{doc.END}\nafter\n")
