"""The data build's Beam transforms, one module per stage: read, tokenize, instance_transform, shards
(metrics and spill are shared helpers). The pure functions they call live one level up."""
from data_pipeline import beam_tuning

beam_tuning.shorten_state_sampler_period()  # see beam_tuning: up to 200 ms idle per bundle otherwise
beam_tuning.cache_dofn_specs()  # see beam_tuning: ~28,000 inspect.Signature builds per 1x build otherwise
beam_tuning.cache_option_views()  # see beam_tuning: ~580 argparse parses of every option class per 1x build otherwise
