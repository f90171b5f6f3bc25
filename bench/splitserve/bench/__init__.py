"""The serving benchmark behind `splitserve bench` (load generator, stats, tables, plots)."""
