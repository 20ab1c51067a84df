"""What the FlexPipe sensors share: their evaluation interval (``FLEXPIPE_SENSOR_INTERVAL_S``)."""

from flexpipe_dag.core.settings import env_value

#: Sensor evaluation interval, seconds (``FLEXPIPE_SENSOR_INTERVAL_S``, 1..86400, default 30); a bad value
#: fails loading the code location with an InputError naming the variable.
SENSOR_INTERVAL_S = env_value("FLEXPIPE_SENSOR_INTERVAL_S", int, 30, ge=1, le=86_400, unit="seconds")
