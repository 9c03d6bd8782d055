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

	"github.com/etcdsync/etcdsync"
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

// child is the command lockctl runs, under its guard (see guard.go): the
// guard's process, the command's process group, the pipe that hands the
// guard the session's deadline, and the guard's records.
type child struct {
	guard     *exec.Cmd
	exited    chan struct{} // closed once the guard is reaped
	pgid      int           // the command's process group (its leader's PID)
	deadlines *os.File      // lockctl's end of the deadlines pipe
	records   chan guardRecord
}

// startChild starts the executable at path with argv (argv[0] is its name)
// and env, with lockctl's stdin, stdout and stderr, as the leader of a new
// process group, under a guard that kills the group at deadline unless
// supervise moves it on (see guard.go), and with grace after lockctl dies.
// It blocks until the command has started or failed to (exit 126); the
// caller then supervises the child, which joins the goroutines started here.
func startChild(path string, argv, env []string, grace time.Duration, deadline time.Time) (*child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find lockctl's own executable for the guard: %w", err)
	}
	dr, dw, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	rr, rw, err := os.Pipe()
	if err != nil {
		dr.Close()
		dw.Close()
		return nil, err
	}
	defer dr.Close()
	defer rw.Close()
	if err := writeDeadline(dw, deadline); err != nil { // the pipe holds it for the guard
		dw.Close()
		rr.Close()
		return nil, err
	}
	guard := &exec.Cmd{
		Path:        exe,
		Args:        append([]string{"lockctl", guardArg, grace.String(), path}, argv...),
		Env:         env,
		Stdin:       os.Stdin,
		Stdout:      os.Stdout,
		Stderr:      os.Stderr,
		ExtraFiles:  []*os.File{dr, rw}, // 3 and 4
		SysProcAttr: &syscall.SysProcAttr{Setpgid: true},
	}
	if err := guard.Start(); err != nil {
		dw.Close()
		rr.Close()
		return nil, fail(exitFailure, fmt.Errorf("start the guard: %w", err))
	}
	c := &child{guard: guard, exited: make(chan struct{}), deadlines: dw, records: make(chan guardRecord)}
	go func() {
		defer close(c.exited)
		guard.Wait()
	}()
	go func() {
		defer rr.Close()
		readRecords(rr, c.records)
	}()
	rec, ok := <-c.records
	if ok && rec.kind == recStarted {
		c.pgid = rec.pgid
		return c, nil
	}
	for range c.records { // to the guard's end
	}
	<-c.exited
	dw.Close()
	if ok && rec.kind == recFailed {
		return nil, fail(exitNoExec, fmt.Errorf("%s: %s", path, rec.msg))
	}
	return nil, fail(exitFailure, fmt.Errorf("the guard ended before the command started: %v", guard.ProcessState))
}

// signal sends sig to the command's whole process group. A group with no
// process left is not an error.
func (c *child) signal(sig syscall.Signal) {
	syscall.Kill(-c.pgid, sig)
}

// feed hands the guard the session's local deadline each time it moves,
// until the hold ends (lost closes), stop closes or the guard is gone. It
// blocks until then.
func (c *child) feed(s *etcdsync.Session, lost, stop <-chan struct{}) {
	for s.Err() == nil {
		moved := s.DeadlineMoved()
		if writeDeadline(c.deadlines, s.Deadline()) != nil {
			return
		}
		select {
		case <-moved:
		case <-lost:
			return
		case <-stop:
			return
		}
	}
}

// outcome is how the command ended.
type outcome struct {
	status  syscall.WaitStatus // the command's, once exited
	exited  bool
	stopped syscall.Signal // after a loss: SIGTERM, or SIGKILL once --grace or the deadline passed; 0 without a loss
	guard   error          // the guard ended before telling the command's status
}

// code is the exit code for the outcome: 128+signal when the group was
// stopped after a loss (143 or 137), else the command's own status (128+N
// when signal N ended it).
func (o outcome) code() int {
	switch {
	case o.stopped != 0:
		return exitSignal + int(o.stopped)
	case o.status.Signaled():
		return exitSignal + int(o.status.Signal())
	}
	return o.status.ExitStatus()
}

// lossHooks are what supervise reports through.
type lossHooks struct {
	loss     func() syscall.Signal // the hold ended while the command ran: says so, returns the signal for the group now
	leftover func()                // the command left processes in its group
	deadline func()                // the guard killed the group at the deadline, no loss reported before
}

// supervise blocks until the command's process group has ended and the
// guard has exited. Meanwhile it hands the guard the session's deadline (see
// feed), and forwards each signal from sigs to the group. When lost closes
// while the command runs, it calls hooks.loss and sends the group the signal
// that returns: SIGTERM, then SIGKILL once grace has passed; or SIGKILL at
// once. Processes the command leaves in its group get the same (hooks.leftover
// is called first, unless a signal was forwarded), since the hold must
// outlive every one of them. It joins the goroutines it and startChild
// started, and closes the deadlines pipe, before returning.
func (c *child) supervise(s *etcdsync.Session, sigs <-chan os.Signal, lost <-chan struct{}, grace time.Duration, hooks lossHooks) outcome {
	stopFeed, fed := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(fed)
		c.feed(s, lost, stopFeed)
	}()
	defer func() {
		close(stopFeed)
		<-fed
		c.deadlines.Close()
	}()

	var out outcome
	var timer *time.Timer
	var kill <-chan time.Time // fires grace after SIGTERM
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	stop := func(sig syscall.Signal) { // SIGTERM now and SIGKILL after grace, once; or SIGKILL now
		if sig == syscall.SIGKILL {
			c.signal(sig)
		} else if timer == nil {
			c.signal(sig)
			timer = time.NewTimer(grace)
			kill = timer.C
		}
	}
	signalled := false // a signal was forwarded: the group is asked to end
	for {
		select {
		case rec, ok := <-c.records:
			if !ok {
				<-c.exited
				if !out.exited { // the guard died under the command: end the group
					out.guard = fmt.Errorf("the guard ended (%v) while the command ran; its process group got SIGKILL", c.guard.ProcessState)
					c.signal(syscall.SIGKILL)
					reapGroup(c.pgid)
				}
				return out
			}
			switch rec.kind {
			case recExited:
				out.status, out.exited = rec.status, true
				if rec.left && timer == nil && out.stopped != syscall.SIGKILL {
					if !signalled { // else they may just be ending
						hooks.leftover()
					}
					stop(syscall.SIGTERM)
				}
			case recKilled:
				if lost != nil {
					lost = nil
					hooks.deadline()
				}
				out.stopped = syscall.SIGKILL
			}
		case sig := <-sigs:
			c.signal(sysSignal(sig))
			signalled = true
		case <-lost:
			lost = nil
			if out.exited { // the command ended first: its status stands
				continue
			}
			sig := hooks.loss()
			out.stopped = sig
			stop(sig)
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

// lossSignal is the signal the command's group gets when h ends under it:
// SIGKILL when contact with etcd was lost (the session's deadline has
// passed: etcd may give the hold to another now), else SIGTERM, then SIGKILL
// after --grace or at the session's deadline, whichever comes first.
func lossSignal(h hold) syscall.Signal {
	if errors.Is(h.Err(), etcdsync.ErrLostContact) {
		return syscall.SIGKILL
	}
	return syscall.SIGTERM
}

// lossMessage is the line lockctl prints when h ends under the command.
func lossMessage(h hold, name string, grace time.Duration) error {
	if lossSignal(h) == syscall.SIGKILL {
		return fmt.Errorf("lost the %s on %s: %v; killing the command's process group (SIGKILL): etcd may give the %s to another holder from now on", h.what, name, h.Err(), h.what)
	}
	return fmt.Errorf("lost the %s on %s: %v; sending SIGTERM to the command's process group (SIGKILL after --grace %v, or at the session's deadline if sooner)", h.what, name, h.Err(), grace)
}

// deadlineMessage is the line lockctl prints when the guard killed the
// command's group at the session's deadline before lockctl saw a loss
// (lockctl was stopped, or could not keep up).
func deadlineMessage(h hold, name string) error {
	cause := "no keepalive acknowledged in time moved the session's deadline on (was lockctl stopped?)"
	if err := h.Err(); err != nil {
		cause = err.Error()
	}
	return fmt.Errorf("lost the %s on %s: %s; the guard killed the command's process group (SIGKILL) at the session's deadline", h.what, name, cause)
}
