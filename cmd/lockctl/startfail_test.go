//go:build unix

package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// startBound bounds how long a lockctl whose command cannot start may take
// from its own start to its exit: connecting, taking the lock, the guard's
// report, the release (about a tenth of that on an idle machine).
const startBound = 3 * time.Second * slowdown

// lockFree checks that the lock on name can be taken at once (--try) and
// that nothing is left under it.
func lockFree(t *testing.T, name string) {
	t.Helper()
	code, p := run(t, "run", "--try", name, "--", "true")
	require.Equal(t, 0, code, "the lock is not free: %s", p.stderr.String())
	noKeys(t, name)
}

// writeExec writes an executable file (mode 0755, or mode) at path.
func writeExec(t *testing.T, path, content string, mode os.FileMode) {
	t.Helper()
	require.NoError(t, os.WriteFile(path, []byte(content), mode))
	require.NoError(t, os.Chmod(path, mode))
}

// A command that cannot be started ends lockctl at once: exit 126 when it
// is there but cannot run, 127 when it is not there, as in sh, with one line
// that names the command and the cause; the lock is free at once. ENOEXEC
// and a missing #! interpreter fail in the guard's exec, with the lock
// taken; the others fail before it is taken.
func TestCommandThatCannotStart(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	noShebang, badInterp := filepath.Join(dir, "no-shebang"), filepath.Join(dir, "bad-interp")
	notExec, aDir := filepath.Join(dir, "not-exec"), filepath.Join(dir, "a-dir")
	writeExec(t, noShebang, "vm\n", 0o755)
	writeExec(t, badInterp, "#!/no/such/interpreter\necho hi\n", 0o755)
	writeExec(t, notExec, "#!/bin/sh\necho hi\n", 0o644)
	require.NoError(t, os.Mkdir(aDir, 0o755))
	for _, tc := range []struct {
		what  string
		cmd   string
		code  int
		cause string
	}{
		{"no #! line (ENOEXEC)", noShebang, exitNoExec, "exec format error"},
		{"missing interpreter", badInterp, exitNoExec, "its interpreter /no/such/interpreter (the #! line) was not found"},
		{"no x bit (EACCES)", notExec, exitNoExec, "permission denied"},
		{"a directory", aDir, exitNoExec, "is a directory"},
		{"no such file (ENOENT)", filepath.Join(dir, "missing"), exitNotFound, "not found"},
		{"not in PATH", "no-such-command-lockctl-test", exitNotFound, "not found in $PATH"},
	} {
		t.Run(tc.what, func(t *testing.T) {
			t.Parallel()
			name := uniqueName(t)
			code, p := run(t, "run", name, "--", tc.cmd, "arg")
			took := p.ended.Sub(p.started)
			t.Logf("exit %d after %v: %s", code, took, p.stderr.String())
			require.Equal(t, tc.code, code, "stderr: %s", p.stderr.String())
			line := oneLine(t, p.stderr.String())
			require.Contains(t, line, "lockctl: "+tc.cmd+": ")
			require.Contains(t, line, tc.cause)
			require.Less(t, took, startBound)
			lockFree(t, name)
		})
	}
}

// An argument list too long to exec (E2BIG) is exit 126 with the lock
// released at once. lockctl itself must start with the arguments, so the
// limit is lowered under it while it waits for the lock: one argument
// cannot be longer than 128 KiB, and all of them fit in a quarter of the
// stack's limit (2 MiB by default), which lockctl's own start needs too.
func TestCommandArgumentsTooLong(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	holder, release := holding(t, dir, "run", name)
	arg := strings.Repeat("a", 100_000)
	args := []string{"run", "--quiet", name, "--", "true"}
	for range 10 { // 1 MB in all
		args = append(args, arg)
	}
	p := start(t, args...)
	waitKeys(t, name+"/", 2)
	var lim unix.Rlimit
	require.NoError(t, unix.Prlimit(p.cmd.Process.Pid, unix.RLIMIT_STACK, nil, &lim))
	lim.Cur = 1 << 20 // exec's limit: 256 KiB
	require.NoError(t, unix.Prlimit(p.cmd.Process.Pid, unix.RLIMIT_STACK, &lim, nil))
	touch(t, release)
	require.Equal(t, 0, holder.wait(t))
	begin := time.Now()
	require.Equal(t, exitNoExec, p.wait(t), "stderr: %s", p.stderr.String())
	took := time.Since(begin)
	t.Logf("exit after %v: %s", took, p.stderr.String())
	line := oneLine(t, p.stderr.String())
	require.Contains(t, line, "lockctl: true: ")
	require.Contains(t, line, "argument list too long")
	require.Less(t, took, startBound)
	lockFree(t, name)
}

// ownLockctl is a copy of the built lockctl in dir, which a test may
// replace while it runs (lockctl starts its guard from its own path).
func ownLockctl(t *testing.T, dir string) string {
	t.Helper()
	path := filepath.Join(dir, "lockctl")
	src, err := os.Open(bin)
	require.NoError(t, err)
	defer src.Close()
	dst, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o755)
	require.NoError(t, err)
	_, err = io.Copy(dst, src)
	require.NoError(t, errors.Join(err, dst.Close()))
	return path
}

// replaceGuard has a lockctl started from path, waiting for the lock on
// name that the holder in dir holds, start script as its guard: it puts
// the script at path (the running lockctl keeps its own file) and lets the
// holder end. With script "", path is removed instead.
func replaceGuard(t *testing.T, path, script string, release string, holder *ctl) {
	t.Helper()
	require.NoError(t, os.Remove(path))
	if script != "" {
		writeExec(t, path, script, 0o755)
	}
	touch(t, release)
	require.Equal(t, 0, holder.wait(t))
}

// When the guard cannot start, dies before it reports, reports that its
// fork failed (EAGAIN, which cannot be provoked for root: RLIMIT_NPROC
// does not apply to it), does not report, or reports that the deadline
// had passed, lockctl starts nothing, releases the lock at once and exits
// with one line: 126, or 137 for the passed deadline (a loss).
func TestGuardThatDoesNotStartCommand(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		what   string
		script string // the guard; "" for none (its file is gone)
		code   int
		cause  string
		took   time.Duration // at most, once the lock is free
	}{
		{"cannot start", "", exitNoExec, "its guard (lockctl __guard) could not be started", startBound},
		{"dies", "#!/bin/sh\nkill -9 $$\n", exitNoExec, "its guard (lockctl __guard) ended before it reported (signal: killed)", startBound},
		{"exits", "#!/bin/sh\nexit 0\n", exitNoExec, "its guard (lockctl __guard) ended before it reported (exit status 0)", startBound},
		{"fork failed", "#!/bin/sh\necho 'failed 11 fork/exec /bin/true: resource temporarily unavailable' >&4\n", exitNoExec, "cannot run: resource temporarily unavailable", startBound},
		{"no report", "#!/bin/sh\nexec sleep 60\n", exitNoExec, "its guard did not report by the session's deadline", 2*time.Second + startBound},
		{"deadline passed", "#!/bin/sh\necho expired >&4\n", exitSignal + int(syscall.SIGKILL), "the guard did not start it", startBound},
	} {
		t.Run(tc.what, func(t *testing.T) {
			t.Parallel()
			name, dir := uniqueName(t), t.TempDir()
			self := ownLockctl(t, dir)
			holder, release := holding(t, dir, "run", name)
			ran := filepath.Join(dir, "ran")
			p := startWith(t, opts{bin: self}, "run", "--quiet", "--ttl", "2s", name, "--", "touch", ran)
			waitKeys(t, name+"/", 2)
			replaceGuard(t, self, tc.script, release, holder)
			begin := time.Now()
			code := p.wait(t)
			took := time.Since(begin)
			t.Logf("exit %d after %v: %s", code, took, p.stderr.String())
			require.Equal(t, tc.code, code, "stderr: %s", p.stderr.String())
			line := oneLine(t, p.stderr.String())
			require.Contains(t, line, tc.cause)
			if tc.code == exitNoExec {
				require.Contains(t, line, "lockctl: touch")
			} else {
				require.Contains(t, line, "lost the lock on "+name)
			}
			require.Less(t, took, tc.took)
			require.NoFileExists(t, ran)
			lockFree(t, name)
		})
	}
}

// The exit code for a command whose exec failed with an errno, as the guard
// reports it: 127 only when the file is not there.
func TestStartFailureCodes(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	there := filepath.Join(dir, "there")
	writeExec(t, there, "\x7fELF", 0o755)
	for _, tc := range []struct {
		path  string
		err   error
		code  int
		cause string
	}{
		{filepath.Join(dir, "gone"), syscall.ENOENT, exitNotFound, "not found"},
		{there, syscall.ENOENT, exitNoExec, "its ELF interpreter"},
		{there, syscall.ENOEXEC, exitNoExec, "exec format error"},
		{there, syscall.EAGAIN, exitNoExec, "resource temporarily unavailable"},
		{there, syscall.E2BIG, exitNoExec, "argument list too long"},
		{there, syscall.ETXTBSY, exitNoExec, "text file busy"},
		{there, fmt.Errorf("no errno"), exitNoExec, "no errno"},
	} {
		err := startFailure("cmd", tc.path, tc.err)
		var ee *exitError
		require.ErrorAs(t, err, &ee)
		require.Equal(t, tc.code, ee.code, "%v: %v", tc.err, err)
		require.Contains(t, err.Error(), tc.cause)
		require.True(t, strings.HasPrefix(err.Error(), "cmd ("+tc.path+"): "), "%v", err)
	}
}
