"""Credentials given as Beam options never reach the log or the manifest."""
import json
import logging

from data_pipeline import build_records
from bertdist.redaction import REDACTED, redact_args


def test_secret_named_options_lose_their_values_in_both_forms():
    args = ["--runner=DataflowRunner", "--s3_secret_access_key=AbC/123+xyz", "--s3_session_token", "FwoGZXIvYXdz",
            "--azure_connection_string=DefaultEndpointsProtocol=https;AccountKey=k==", "--project", "my-proj",
            "--hdfs_user", "alice", "--password=", "--api-token", "t0k"]
    out = redact_args(args)
    assert out == ["--runner=DataflowRunner", f"--s3_secret_access_key={REDACTED}", "--s3_session_token", REDACTED,
                   f"--azure_connection_string={REDACTED}", "--project", "my-proj", "--hdfs_user", "alice",
                   f"--password={REDACTED}", "--api-token", REDACTED]
    assert redact_args(["--s3_access_key_id", "--runner=DirectRunner"]) == ["--s3_access_key_id", "--runner=DirectRunner"]


def test_a_build_with_a_credential_option_keeps_it_out_of_log_and_manifest(repo_root, small_vocab, tmp_path, caplog):
    secret = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
    args = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1",
            f"--s3_secret_access_key={secret}", "--s3_session_token", secret]
    with caplog.at_level(logging.INFO, logger="data_pipeline"):
        manifest = build_records([f"books:{repo_root / 'data_pipeline' / 'samples' / 'books'}"], tmp_path / "out",
                                 small_vocab, pipeline_args=args, max_seq_length=64, dupe_factor=1, num_shards=1)
    text = manifest.read_text()
    assert secret not in text and secret not in caplog.text
    recorded = json.loads(text)["beam_args"]
    assert f"--s3_secret_access_key={REDACTED}" in recorded and "--s3_session_token" in recorded
    assert "Beam args" in caplog.text and REDACTED in caplog.text
