"""Drivers of the round engine, side by side: the MQTT daemon (`mqtt`), the in-process
simulation (`local`) and the replay of a recorded run (`replay`)."""
