package k8sdiscovery

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// NewPods connects to the cluster the way kubectl and sglang-router do: the
// kubeconfig ($KUBECONFIG, else ~/.kube/config) when there is one, else the
// pod's service account. It talks to the core/v1 pods API only: client-go's
// generated clientset would link every API group's types into pdrouter
// (a 38 MB binary instead of about 28 MB).
func NewPods(namespace string) (Pods, error) {
	cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(clientcmd.NewDefaultClientConfigLoadingRules(),
		&clientcmd.ConfigOverrides{}).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("service discovery: no Kubernetes configuration (neither a kubeconfig nor in-cluster): %w", err)
	}
	return podsFor(cfg, namespace)
}

func podsFor(cfg *rest.Config, namespace string) (Pods, error) {
	scheme := runtime.NewScheme()
	if err := corev1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	c := rest.CopyConfig(cfg)
	c.GroupVersion = &corev1.SchemeGroupVersion
	c.APIPath = "/api"
	c.NegotiatedSerializer = serializer.NewCodecFactory(scheme).WithoutConversion()
	if c.UserAgent == "" {
		c.UserAgent = "pdrouter"
	}
	client, err := rest.RESTClientFor(c)
	if err != nil {
		return nil, fmt.Errorf("service discovery: %w", err)
	}
	return &restPods{client: client, namespace: namespace}, nil
}

// restPods is the pods part of client-go's typed core/v1 client.
type restPods struct {
	client    rest.Interface
	namespace string
}

func (p *restPods) List(ctx context.Context, opts metav1.ListOptions) (*corev1.PodList, error) {
	out := &corev1.PodList{}
	err := p.client.Get().Namespace(p.namespace).Resource("pods").
		VersionedParams(&opts, metav1.ParameterCodec).Do(ctx).Into(out)
	return out, err
}

func (p *restPods) Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	opts.Watch = true
	return p.client.Get().Namespace(p.namespace).Resource("pods").
		VersionedParams(&opts, metav1.ParameterCodec).Watch(ctx)
}
