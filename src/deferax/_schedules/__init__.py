"""The schedules a site can run on, one final Module each under `AbstractSchedule`."""
