//! Control-channel messages between workers and the controller. (Being built: see issue 5.)
