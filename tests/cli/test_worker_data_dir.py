"""`runwatch worker`'s data directory (issue 34): made with its parents (the default, .runwatch/worker, in an
empty folder or the image's working directory, killed every worker at start), and one that cannot be made
or written is one line and exit 2 before the broker is reached, not a traceback 5 s later."""

from __future__ import annotations

from click.testing import CliRunner

from runwatch.cli.main import main


def _worker(folder, data_dir: str):
    # (no broker listens at port 1: the data directory is checked before the broker is reached)
    return CliRunner().invoke(
        main, ["worker", "--bootstrap", "127.0.0.1:1", "--web-port", "0", "--data-dir", data_dir], env={}
    )


def test_a_data_dir_that_cannot_be_made_is_one_line_and_exit_2(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = _worker(tmp_path, str(blocker / "worker"))
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"error: cannot write to {blocker / 'worker'}: Not a directory; give --data-dir a folder this user "
        "can write"
    ]


def test_the_data_dir_is_made_with_its_parents(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = _worker(tmp_path, str(tmp_path / "deep" / ".runwatch" / "worker"))
    assert (tmp_path / "deep" / ".runwatch" / "worker").is_dir()
    # it went on past the folder: to the keys (none given here), before any broker
    assert result.exit_code == 2 and "cannot write" not in result.output, result.output
