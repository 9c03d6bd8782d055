//go:build unix

package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"time"
)

// forwarded are the signals lockctl catches and passes to the command's
// process group.
var forwarded = []os.Signal{syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT}

// notifySignals starts catching the forwarded signals on the returned
// channel; stop undoes it. It does not block.
func notifySignals() (sigs <-chan os.Signal, stop func()) {
	ch := make(chan os.Signal, len(forwarded))
	signal.Notify(ch, forwarded...)
	return ch, func() { signal.Stop(ch) }
}

// sysSignal returns sig as a syscall.Signal (every signal is one on Unix).
func sysSignal(sig os.Signal) syscall.Signal {
	if s, ok := sig.(syscall.Signal); ok {
		return s
	}
	return syscall.SIGTERM
}

// lookCommand finds the command's executable as exec does, before any lock
// is taken: a command that cannot run is exit 127 (not found) or 126 (not
// executable), as in sh.
func lookCommand(name string) (string, error) {
	path, err := exec.LookPath(name)
	switch {
	case err == nil:
		return path, nil
	case errors.Is(err, fs.ErrPermission):
		return "", fail(exitNoExec, err)
	}
	return "", fail(exitNotFound, err)
}

// child is the command lockctl runs, as the leader of a process group of
// its own (its group ID is its PID).
type child struct {
	cmd    *exec.Cmd
	pgid   int
	exited chan struct{} // closed once the leader is reaped; cmd.ProcessState is set then
}

// startChild starts the executable at path with argv (argv[0] is its name)
// and env, with lockctl's stdin, stdout and stderr, as the leader of a new
// process group. It does not block: a goroutine waits for the leader and
// closes exited (supervise joins it). A start failure is exit 126.
func startChild(path string, argv, env []string) (*child, error) {
	cmd := &exec.Cmd{
		Path:        path,
		Args:        argv,
		Env:         env,
		Stdin:       os.Stdin,
		Stdout:      os.Stdout,
		Stderr:      os.Stderr,
		SysProcAttr: &syscall.SysProcAttr{Setpgid: true},
	}
	if err := cmd.Start(); err != nil {
		return nil, fail(exitNoExec, err)
	}
	c := &child{cmd: cmd, pgid: cmd.Process.Pid, exited: make(chan struct{})}
	go func() {
		defer close(c.exited)
		cmd.Wait() // the status is in cmd.ProcessState
	}()
	return c, nil
}

// signal sends sig to the command's whole process group. A group with no
// process left is not an error.
func (c *child) signal(sig syscall.Signal) {
	syscall.Kill(-c.pgid, sig)
}

// outcome is how the command ended.
type outcome struct {
	state   *os.ProcessState // the leader's
	stopped syscall.Signal   // after a loss: SIGTERM, or SIGKILL once --grace passed; 0 without a loss
}

// code is the exit code for the outcome: 128+signal when the group was
// stopped after a loss (143 or 137), else the leader's own status (128+N
// when signal N ended it).
func (o outcome) code() int {
	if o.stopped != 0 {
		return exitSignal + int(o.stopped)
	}
	ws, ok := o.state.Sys().(syscall.WaitStatus)
	switch {
	case !ok:
		return o.state.ExitCode()
	case ws.Signaled():
		return exitSignal + int(ws.Signal())
	}
	return ws.ExitStatus()
}

// supervise blocks until the command's process group has ended: the leader
// has exited and lockctl has no child left in the group (see reapGroup).
// Meanwhile it forwards each signal from sigs to the group. When lost closes
// while the leader runs, it calls onLoss, sends SIGTERM to the group, and
// SIGKILL once grace has passed. Processes the leader leaves in its group
// get the same (onLeftover is called first, unless a signal was forwarded),
// since the hold must outlive every one of them. It joins the goroutines it starts before returning.
func (c *child) supervise(sigs <-chan os.Signal, lost <-chan struct{}, grace time.Duration, onLoss, onLeftover func()) outcome {
	var out outcome
	var timer *time.Timer
	var kill <-chan time.Time // fires grace after SIGTERM
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	stop := func() { // SIGTERM now, SIGKILL after grace; once
		if timer == nil {
			c.signal(syscall.SIGTERM)
			timer = time.NewTimer(grace)
			kill = timer.C
		}
	}
	exited := c.exited
	var gone chan struct{} // closed when reapGroup returns; nil while the leader runs
	signalled := false     // a signal was forwarded: the group is asked to end
	for {
		select {
		case <-exited:
			exited = nil
			out.state = c.cmd.ProcessState
			if !groupLeft(c.pgid) {
				return out
			}
			if timer == nil {
				if !signalled { // else they may just be ending
					onLeftover()
				}
				stop()
			}
			gone = make(chan struct{})
			go func() {
				defer close(gone)
				reapGroup(c.pgid)
			}()
		case <-gone:
			return out
		case sig := <-sigs:
			c.signal(sysSignal(sig))
			signalled = true
		case <-lost:
			lost = nil
			if exited == nil { // the leader ended first: its status stands
				continue
			}
			onLoss()
			out.stopped = syscall.SIGTERM
			stop()
		case <-kill:
			kill = nil
			c.signal(syscall.SIGKILL)
			if out.stopped != 0 {
				out.stopped = syscall.SIGKILL
			}
		}
	}
}

// groupLeft reports whether any process of group pgid is left, after
// reaping those of lockctl's children in it that have exited. It does not
// block.
func groupLeft(pgid int) bool {
	for {
		pid, err := syscall.Wait4(-pgid, nil, syscall.WNOHANG, nil)
		if err == syscall.EINTR {
			continue
		}
		if err != nil || pid == 0 { // none of our children in it, or none exited
			break
		}
	}
	return syscall.Kill(-pgid, 0) == nil
}

// reapGroup blocks until lockctl has no child left in group pgid, reaping
// each as it exits. As a child subreaper (see becomeSubreaper) lockctl
// inherits the group's orphans, so this waits for the whole group; without
// it, only for lockctl's own children.
func reapGroup(pgid int) {
	for {
		_, err := syscall.Wait4(-pgid, nil, 0, nil)
		if err == syscall.EINTR {
			continue
		}
		if err != nil { // ECHILD: none left
			return
		}
	}
}

// lossMessage is the line lockctl prints when a hold ends under the command.
func lossMessage(h hold, name string, grace time.Duration) error {
	return fmt.Errorf("lost the %s on %s: %v; sending SIGTERM to the command's process group (SIGKILL after --grace %v)", h.what, name, h.Err(), grace)
}
