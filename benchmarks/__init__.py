"""Measurements, not tests: timings on a shared machine are reported, never asserted."""
