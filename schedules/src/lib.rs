//! weightsync-schedules: the pure planner. (Being built: see issue 3.)
