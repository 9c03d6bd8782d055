package queue

import (
	"testing"
	"testing/synctest"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// A client whose serializable read came back behind reads linearizably at
// once for behindFor, then tries serializable reads again; another client
// is not affected.
func TestCapsBehindForAMinute(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		a, b := capsOf(&clientv3.Client{}), capsOf(&clientv3.Client{})
		if a.cached() {
			t.Fatal("a new client reads linearizably at once")
		}
		a.behind()
		if !a.cached() || b.cached() {
			t.Fatalf("after a read behind: cached %v, the other client %v; want true, false", a.cached(), b.cached())
		}
		time.Sleep(behindFor - time.Second)
		if !a.cached() {
			t.Fatal("a client stopped reading linearizably before behindFor")
		}
		time.Sleep(time.Second)
		if a.cached() {
			t.Fatal("a client still reads linearizably at once after behindFor")
		}
	})
}
