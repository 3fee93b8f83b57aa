"""What a run does and costs: metric sinks (metrics), throughput and MFU (throughput, flops), the
memory plan (memory_plan), the compiled step's collectives (hlo, communication) and profiler
traces (profiler, trace)."""
