"""The Beam data pipeline: raw text to sharded MLM/NSP training records."""
