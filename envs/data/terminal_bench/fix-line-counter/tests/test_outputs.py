import os
import subprocess

APP = os.environ["APP_DIR"]


def count(directory):
  out = subprocess.run(["bash", os.path.join(APP, "count_lines.sh"), str(directory)],
                       capture_output=True, text=True, timeout=10)
  return out.stdout.strip()


def test_sample_notes():
  assert count(os.path.join(APP, "notes")) == "5"


def test_names_with_spaces_and_other_files(tmp_path):
  (tmp_path / "my notes.txt").write_text("1\n2\n3\n4\n")
  (tmp_path / "b.txt").write_text("x\n")
  (tmp_path / "c.log").write_text("not\ncounted\n")
  assert count(tmp_path) == "5"


def test_no_txt_files(tmp_path):
  assert count(tmp_path) == "0"
