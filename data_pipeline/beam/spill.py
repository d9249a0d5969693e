"""Buffer elements and spill them to files, so large data never goes through the runner's shuffle."""
from __future__ import annotations

import apache_beam as beam


class BufferedSpillDoFn(beam.DoFn):
    """Buffers elements until their ``size_of`` reaches ``limit``, then hands the buffer to
    ``spill`` (which writes a file and yields small references); the rest is spilled when the
    bundle ends."""

    limit: int

    def size_of(self, element) -> int:
        raise NotImplementedError

    def spill(self, buffer: list):
        raise NotImplementedError

    def start_bundle(self):
        self.buffer, self.size = [], 0

    def process(self, element):
        self.buffer.append(element)
        self.size += self.size_of(element)
        if self.size >= self.limit:
            yield from self._flush()

    def finish_bundle(self):
        from apache_beam.transforms.window import GlobalWindow
        from apache_beam.utils.timestamp import MIN_TIMESTAMP
        from apache_beam.utils.windowed_value import WindowedValue

        for out in self._flush():
            if isinstance(out, beam.pvalue.TaggedOutput):
                yield beam.pvalue.TaggedOutput(out.tag, WindowedValue(out.value, MIN_TIMESTAMP, [GlobalWindow()]))
            else:
                yield WindowedValue(out, MIN_TIMESTAMP, [GlobalWindow()])

    def _flush(self):
        if self.buffer:
            buffer, self.buffer, self.size = self.buffer, [], 0
            yield from self.spill(buffer)
