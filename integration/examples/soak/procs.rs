//! The consumer processes: spawned from this same binary (`soak consume ...`), killed
//! with SIGKILL, respawned.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One slot's process, or when it is due back.
enum Slot {
    Running(Child),
    Down { respawn_at: Instant },
}

/// The run's consumer processes, one per slot.
pub struct Consumers {
    /// The arguments after `consume` for slot `i`.
    args: Box<dyn Fn(usize) -> Vec<String> + Send>,
    /// Where each slot's standard error goes (appended).
    logs: PathBuf,
    slots: Vec<Slot>,
    /// Set at the end of a run: nothing is respawned any more.
    stopping: bool,
}

impl Consumers {
    /// Starts `n` consumers, slot `i` with `args(i)`; their standard error is appended
    /// to `consumer-{i}.log` under `logs`.
    pub fn start(
        n: usize,
        logs: PathBuf,
        args: impl Fn(usize) -> Vec<String> + Send + 'static,
    ) -> std::io::Result<Consumers> {
        let mut consumers =
            Consumers { args: Box::new(args), logs, slots: Vec::new(), stopping: false };
        for slot in 0..n {
            let child = consumers.spawn(slot)?;
            consumers.slots.push(Slot::Running(child));
        }
        Ok(consumers)
    }

    fn spawn(&self, slot: usize) -> std::io::Result<Child> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.logs.join(format!("consumer-{slot}.log")))?;
        let child = Command::new(std::env::current_exe()?)
            .arg("consume")
            .args((self.args)(slot))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        tracing::debug!(slot, pid = child.id(), "consumer started");
        Ok(child)
    }

    /// How many slots there are.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Kills slot `slot`'s process with SIGKILL (it comes back after `down`); answers
    /// its pid, or `None` if it was down already.
    pub fn kill(&mut self, slot: usize, down: Duration) -> Option<u32> {
        let Slot::Running(child) = &mut self.slots[slot] else { return None };
        let pid = child.id();
        let _ = child.kill();
        let _ = child.wait();
        self.slots[slot] = Slot::Down { respawn_at: Instant::now() + down };
        Some(pid)
    }

    /// Respawns the slots that are due, and those whose process exited by itself.
    pub fn tend(&mut self) {
        if self.stopping {
            return;
        }
        for slot in 0..self.slots.len() {
            let due = match &mut self.slots[slot] {
                Slot::Running(child) => match child.try_wait() {
                    Ok(Some(status)) => {
                        tracing::warn!(slot, %status, "consumer exited by itself; respawning");
                        true
                    }
                    _ => false,
                },
                Slot::Down { respawn_at } => Instant::now() >= *respawn_at,
            };
            if due {
                match self.spawn(slot) {
                    Ok(child) => self.slots[slot] = Slot::Running(child),
                    Err(error) => {
                        tracing::error!(slot, %error, "respawning a consumer failed");
                        let respawn_at = Instant::now() + Duration::from_secs(1);
                        self.slots[slot] = Slot::Down { respawn_at };
                    }
                }
            }
        }
    }

    /// Brings every slot that is down back at once.
    pub fn respawn_all_now(&mut self) {
        for slot in &mut self.slots {
            if let Slot::Down { respawn_at } = slot {
                *respawn_at = Instant::now();
            }
        }
        self.tend();
    }

    /// Kills every process for good.
    pub fn stop(&mut self) {
        self.stopping = true;
        for slot in 0..self.slots.len() {
            self.kill(slot, Duration::ZERO);
        }
    }
}

impl Drop for Consumers {
    fn drop(&mut self) {
        self.stop();
    }
}
