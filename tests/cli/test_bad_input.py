"""Bad input on the command line gets an error that names the file and the fix, or a counted skip,
never a raw traceback."""
import shutil

from bertdist.cli.main import main


def test_a_binary_file_among_the_books_is_a_counted_skip_in_vocab_training(repo_root, tmp_path, capsys):
    books = tmp_path / "books"
    shutil.copytree(repo_root / "data_pipeline" / "samples" / "books", books)
    (books / "zz-scan.txt").write_bytes(bytes(range(256)) * 40)  # not text in any encoding
    rc = main(["data", "vocab", "--input", f"books:{books}", "--output", str(tmp_path / "vocab.txt"), "--size", "400"])
    out = capsys.readouterr().out
    assert rc == 0 and (tmp_path / "vocab.txt").is_file()
    assert "skipped 1 file(s)" in out and "zz-scan.txt (skipped_undecodable_document)" in out


def test_an_input_that_matches_nothing_names_the_pattern(tmp_path, capsys, repo_root):
    missing = tmp_path / "no-such-books"
    assert main(["data", "vocab", "--input", f"books:{missing}", "--output", str(tmp_path / "v.txt")]) == 2
    assert f"no input files match '{missing}'" in capsys.readouterr().err
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]) + "\n")
    rc = main(["data", "build", "--config", str(repo_root / "configs" / "data" / "tiny_demo.yaml"), "--input",
               f"books:{missing}", "--vocab", str(vocab), "--output", str(tmp_path / "records")])
    assert rc == 2 and f"no input files match '{missing}'" in capsys.readouterr().err
    assert not (tmp_path / "records" / "manifest.json").exists()
