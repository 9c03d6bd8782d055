//go:build unix

package etcdtest

// Tests of the port reservation (givenPorts, lockPort): a port stays
// reserved for reuseAfter once its cluster closed, and a port locked by
// another process cannot be locked here until that process exits.

import (
	"bufio"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"
)

func TestPortReservedUntilReuseAfter(t *testing.T) {
	t.Parallel()
	ports, err := freePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	p := ports[0]
	givenPorts.release(p)
	if ok, err := givenPorts.give(p); ok || err != nil {
		t.Fatalf("give(%d) just after its release = %v, %v; want false, nil", p, ok, err)
	}
	givenPorts.mu.Lock()
	givenPorts.ports[p] = time.Now().Add(-reuseAfter - time.Second)
	givenPorts.mu.Unlock()
	if ok, err := givenPorts.give(p); !ok || err != nil {
		t.Fatalf("give(%d) reuseAfter after its release = %v, %v; want true, nil", p, ok, err)
	}
	givenPorts.release(p)
}

// portHolderEnv names the port TestPortLockHolder locks, in the child
// process TestPortLockedByAnotherProcess runs.
const portHolderEnv = "ETCDTEST_HOLD_PORT"

func TestPortLockedByAnotherProcess(t *testing.T) {
	t.Parallel()
	port := 40000 + rand.IntN(20000) // above freePorts' range: no member's port
	child := exec.Command(os.Args[0], "-test.run=^TestPortLockHolder$")
	child.Env = append(os.Environ(), portHolderEnv+"="+strconv.Itoa(port))
	child.Stderr = os.Stderr
	stdin, err := child.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { child.Process.Kill(); child.Wait() }) // both fail once the child was waited for: nothing to report
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || line != "locked\n" {
		t.Fatalf("child said %q, %v; want locked", line, err)
	}
	if ok, err := lockPort(port); ok || err != nil {
		t.Fatalf("lockPort(%d) while the child holds it = %v, %v; want false, nil", port, ok, err)
	}
	stdin.Close() // the child exits
	if err := child.Wait(); err != nil {
		t.Fatalf("child: %v", err)
	}
	if ok, err := lockPort(port); !ok || err != nil {
		t.Fatalf("lockPort(%d) after the child exited = %v, %v; want true, nil", port, ok, err)
	}
	if err := unlockPort(port); err != nil {
		t.Fatal(err)
	}
}

// TestPortLockHolder is TestPortLockedByAnotherProcess's child: it locks the
// port, says so on standard output and exits when standard input closes.
func TestPortLockHolder(t *testing.T) {
	port, err := strconv.Atoi(os.Getenv(portHolderEnv))
	if err != nil {
		t.Skip("run by TestPortLockedByAnotherProcess")
	}
	if ok, err := lockPort(port); !ok || err != nil {
		t.Fatalf("lockPort(%d) = %v, %v", port, ok, err)
	}
	os.Stdout.WriteString("locked\n")
	io.Copy(io.Discard, os.Stdin)
}
