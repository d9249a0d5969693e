"""What the Beam stage tests share: in-process DirectRunner options, and a check usable inside
assert_that (which needs an exception, not an assert statement's bool)."""
OPTS = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]


def _check(cond):
    assert cond
