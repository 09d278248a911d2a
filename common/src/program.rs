//! How this process starts another copy of itself.
//!
//! `weightsync demo` runs its trainers and rollouts, and `weightsync bench` its peers, as child
//! processes of the same program. For the `weightsync` binary that program is
//! `std::env::current_exe()`. Inside the Python package the CLI runs in the Python interpreter,
//! and `current_exe()` is `python`, which becomes the CLI again only when told
//! `-m weightsync`. So the entry point that knows how it was started says so once, with
//! [`Program::set_this`], and every site that spawns a copy asks [`Program::this`].

use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// A program to run: an executable and the arguments that come before any of ours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    /// The executable.
    pub path: PathBuf,
    /// Arguments given before the subcommand's own (e.g. `-m weightsync` for Python).
    pub prefix: Vec<OsString>,
}

static THIS: OnceLock<Program> = OnceLock::new();

impl Program {
    /// An executable run with no arguments of its own.
    pub fn new(path: impl Into<PathBuf>) -> Program {
        Program {
            path: path.into(),
            prefix: Vec::new(),
        }
    }

    /// Says how this process runs itself again; the first call wins (a later different one
    /// is an error returning what was already set).
    pub fn set_this(program: Program) -> Result<(), Program> {
        let set = THIS.get_or_init(|| program.clone());
        if *set == program {
            Ok(())
        } else {
            Err(set.clone())
        }
    }

    /// How this process runs itself again: what [`Program::set_this`] said, else this
    /// executable.
    pub fn this() -> std::io::Result<Program> {
        match THIS.get() {
            Some(p) => Ok(p.clone()),
            None => Ok(Program::new(std::env::current_exe()?)),
        }
    }

    /// A [`Command`] for this program, its prefix arguments already given.
    pub fn command(&self) -> Command {
        let mut c = Command::new(&self.path);
        c.args(&self.prefix);
        c
    }
}

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.path.display())?;
        for a in &self.prefix {
            write!(f, " {}", a.to_string_lossy())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_carries_the_prefix_and_the_first_setting_wins() {
        let py = Program {
            path: PathBuf::from("/usr/bin/python3"),
            prefix: vec!["-m".into(), "weightsync".into()],
        };
        assert_eq!(py.to_string(), "/usr/bin/python3 -m weightsync");
        let c = py.command();
        assert_eq!(c.get_program(), "/usr/bin/python3");
        assert_eq!(c.get_args().collect::<Vec<_>>(), ["-m", "weightsync"]);
        assert_eq!(Program::set_this(py.clone()), Ok(()));
        assert_eq!(Program::set_this(py.clone()), Ok(()));
        assert_eq!(Program::set_this(Program::new("/other")), Err(py.clone()));
        assert_eq!(Program::this().unwrap(), py);
    }
}
