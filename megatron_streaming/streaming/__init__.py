"""Streaming DiLoCo: fragments, schedule, codec, transport, outer optimizer and the ZeRO hook that ties them together."""
